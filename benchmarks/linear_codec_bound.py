"""How much can any ResidualKV codec of latent size d_c keep? (SmolLM2-135M, CPU)

The decoder is linear and bias-free, so every reconstruction lies in mean_ref + span(W_d): the best a
codec of size d_c can do is bounded by the best rank-d_c linear code of the residuals r = kv − mean_ref.
This script builds that code in closed form (per layer, through the cache's own write path: schedule,
FP8 references, top-k retrieval), with a *linear* encoder, and measures held-out perplexity through the
compressed cache (INT4 latents, KIVI-4 full layers) against the full cache, for

  alpha = 1    plain PCA: the rank-d_c subspace with the least squared error (what L_rec alone aims at)
  alpha < 1    Fisher-weighted PCA: least error in the metric of the next-token loss (`fisher-pca` init)

    python benchmarks/linear_codec_bound.py --d-c 96,128,192,256,384 --alpha 1.0,0.1
    python benchmarks/linear_codec_bound.py --quick        # d_c 128, alpha 0.1, 4 blocks, 512+32 tokens

Writes benchmarks/results/linear_codec_bound.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from residualkv import accounting  # noqa: E402
from residualkv.backbones import load_backbone  # noqa: E402
from residualkv.cache import ResidualKVCache  # noqa: E402
from residualkv.cli import base_config  # noqa: E402
from residualkv.codec import LayerCodec, ResidualCodec  # noqa: E402
from residualkv.evaluation.perplexity import cache_perplexity, heldout_ids  # noqa: E402
from residualkv.training.packing import pack_documents, resolve_source  # noqa: E402
from residualkv.training.warmstart import capture, residual_pairs, weighted_pca  # noqa: E402
from transformers import DynamicCache  # noqa: E402


class LinearLayerCodec(LayerCodec):
    """A codec with a linear encoder z = (kv − mean_ref)·E: the closed-form code, no SwiGLU fit."""

    def __init__(self, dims, enc: torch.Tensor, dec: torch.Tensor):
        super().__init__(dims)
        self.enc = enc
        with torch.no_grad():
            self.w_d.weight.copy_(dec)

    def f_c(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() @ self.enc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-c", default="96,128,192,256")
    p.add_argument("--alpha", default="1.0,0.1", help="1.0 = plain PCA; < 1 mixes in the Fisher metric")
    p.add_argument("--blocks", type=int, default=24, help="512-token training blocks for the statistics")
    p.add_argument("--group-size", default=None,
                   help="latent quantisation group sizes to try (comma list; default the YAML's); a size must divide d_c")
    p.add_argument("--value-weight", default="1", help="comma list: weight of value errors in the metric (weighted_pca)")
    p.add_argument("--rotate", default="no",
                   help="'no', 'yes' or 'no,yes': also try the code turned by a random orthogonal d_c x d_c matrix "
                        "(spreads the leading components' variance over all coordinates, so one quantisation "
                        "group can span the whole latent; bytes unchanged, the matrix folds into the weights)")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=128, help="held-out tokens scored one by one after the context")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/linear_codec_bound.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.d_c, args.alpha, args.blocks, args.context, args.tokens = "128", "0.1", 4, 512, 32
        args.out = args.out.replace(".json", "_quick.json")
    torch.set_num_threads(args.threads)
    model, tok, spec = load_backbone("smollm2-135m")
    cfg = base_config(spec)
    packed = pack_documents(resolve_source(None), tok, 512)
    blocks = torch.tensor(packed.train[: args.blocks]["input_ids"])
    template = ResidualCodec.for_model(model.config, cfg, d_c=spec.codec["d_c"], d_ff=8, backbone=spec.name)
    t0 = time.time()
    kv, fim = capture(model, blocks, template.layer_ids, fisher=True, progress=True)
    residuals = {i: residual_pairs(kv[i], cfg) for i in template.layer_ids}
    print(f"statistics from {args.blocks} blocks in {time.time() - t0:.0f} s", flush=True)

    ids = heldout_ids(tok, args.context + args.tokens)
    rows = [{"d_c": None, "alpha": None, "method": "full",
             **cache_perplexity(model, DynamicCache(config=model.config), ids, args.context)}]
    print(f"full cache: ppl {rows[0]['ppl']:.3f}", flush=True)
    groups = [int(g) for g in args.group_size.split(",")] if args.group_size else [cfg.group_size]
    rotations = [r.strip() == "yes" for r in args.rotate.split(",")]
    weights = [float(w) for w in args.value_weight.split(",")]
    for alpha, d_c, group, rotate, vw in itertools.product([float(a) for a in args.alpha.split(",")],
                                                           [int(d) for d in args.d_c.split(",")], groups, rotations,
                                                           weights):
        if d_c % group:
            continue
        codec = ResidualCodec.for_model(model.config, cfg, d_c=d_c, d_ff=8, backbone=spec.name)
        kept, split = [], []
        for i in codec.layer_ids:
            x, m = residuals[i]
            enc, dec, share = weighted_pca(x - m, fim[i], d_c, alpha, vw)
            res = x - m  # plain relative error energy of the keys and values the code leaves (unquantised)
            e = res - res @ enc @ dec.T
            h = res.shape[1] // 2
            split.append((float(e[:, :h].pow(2).sum() / x[:, :h].pow(2).sum()),
                          float(e[:, h:].pow(2).sum() / x[:, h:].pow(2).sum())))
            if rotate:
                q = torch.linalg.qr(torch.randn(d_c, d_c, generator=torch.Generator().manual_seed(i)))[0]
                enc, dec = enc @ q, dec @ q  # decoder weight is [2d_k, d_c]: z·q·qᵀ·Wᵀ = z·Wᵀ
            codec.layers[str(i)] = LinearLayerCodec(codec.dims, enc, dec)
            kept.append(share)
        cache = ResidualKVCache.from_model(model, codec, cfg.replace(mode="standalone", group_size=group))
        r = cache_perplexity(model, cache, ids, args.context)
        kr = accounting.report(cache)["kr_measured"]
        rows.append({"d_c": d_c, "alpha": alpha, "group_size": group, "rotated": rotate, "value_weight": vw,
                     "key_error": sum(k for k, _ in split) / len(split), "value_error": sum(v for _, v in split) / len(split),
                     "kr_measured": kr,
                     "method": "plain PCA" if alpha == 1 else "Fisher-weighted PCA",
                     "energy_kept": sum(kept) / len(kept), **r, "ppl_rel": r["ppl"] / rows[0]["ppl"]})
        print(f"alpha {alpha:g} d_c {d_c} group {group}{' rotated' if rotate else ''} value weight {vw:g}: "
              f"key error {rows[-1]['key_error']:.4f}, value error {rows[-1]['value_error']:.4f}, ppl {r['ppl']:.3f} (x{r['ppl'] / rows[0]['ppl']:.3f}), "
              f"KR {kr:.2%}, energy kept {sum(kept) / len(kept):.3f}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"backbone": spec.name, "blocks": args.blocks, "context": args.context,
                               "tokens": args.tokens, "bits": cfg.bits, "machine": platform.platform(),
                               "torch": torch.__version__, "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
