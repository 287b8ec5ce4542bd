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
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

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
    for alpha in [float(a) for a in args.alpha.split(",")]:
        for d_c in [int(d) for d in args.d_c.split(",")]:
            codec = ResidualCodec.for_model(model.config, cfg, d_c=d_c, d_ff=8, backbone=spec.name)
            kept = []
            for i in codec.layer_ids:
                x, m = residuals[i]
                enc, dec, share = weighted_pca(x - m, fim[i], d_c, alpha)
                codec.layers[str(i)] = LinearLayerCodec(codec.dims, enc, dec)
                kept.append(share)
            r = cache_perplexity(model, ResidualKVCache.from_model(model, codec, cfg.replace(mode="standalone")),
                                 ids, args.context)
            rows.append({"d_c": d_c, "alpha": alpha, "method": "plain PCA" if alpha == 1 else "Fisher-weighted PCA",
                         "energy_kept": sum(kept) / len(kept), **r, "ppl_rel": r["ppl"] / rows[0]["ppl"]})
            print(f"alpha {alpha:g} d_c {d_c}: ppl {r['ppl']:.3f} (x{r['ppl'] / rows[0]['ppl']:.3f}), "
                  f"energy kept {sum(kept) / len(kept):.3f}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"backbone": spec.name, "blocks": args.blocks, "context": args.context,
                               "tokens": args.tokens, "bits": cfg.bits, "machine": platform.platform(),
                               "torch": torch.__version__, "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
