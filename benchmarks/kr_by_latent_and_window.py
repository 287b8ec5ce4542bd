"""Measured KR of ResidualKV standalone by latent size d_c and FP16 recent window W (CPU, ~4 min).

    python benchmarks/kr_by_latent_and_window.py --json benchmarks/results/recent_window/kr_by_dc_and_window.json

Bytes do not depend on a codec's weights, so untrained codecs of each size are used: each cell prefills
N random tokens of SmolLM2 into a fresh cache (the backbone YAML's config, `recent_window` = W) and
reads `accounting.report`, the same figures `rkv accounting --decode-steps 0` prints for a trained codec.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from residualkv import accounting  # noqa: E402
from residualkv.backbones import load_backbone  # noqa: E402
from residualkv.cache import ResidualKVCache  # noqa: E402
from residualkv.cli import base_config  # noqa: E402
from residualkv.codec import ResidualCodec  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backbone", default="smollm2-135m")
    p.add_argument("--d-c", default="96,128,160")
    p.add_argument("--windows", default="0,32,48,64")
    p.add_argument("--context-len", default="2048,4096")
    p.add_argument("--json", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    model, _, spec = load_backbone(args.backbone)
    cfg = base_config(spec)
    rows = []
    for n in (int(x) for x in args.context_len.split(",")):
        ids = torch.randint(100, model.config.vocab_size - 100, (1, n), generator=torch.Generator().manual_seed(0))
        for d_c in (int(x) for x in args.d_c.split(",")):
            codec = ResidualCodec.for_model(model.config, cfg, d_c=d_c, d_ff=256)
            for w in (int(x) for x in args.windows.split(",")):
                cache = ResidualKVCache.from_model(model, codec, cfg, recent_window=w)
                with torch.no_grad():
                    model(ids, cache=cache, use_cache=True, logits_to_keep=1)
                rep = accounting.report(cache)
                rows.append({"context_len": n, "d_c": d_c, "recent_window": w, "kr_measured": rep["kr_measured"],
                             "kr_formula": rep["kr_formula"], "unexplained": rep["unexplained"],
                             "recent_window_fp16": rep["bytes"].get("recent_window_fp16", 0)})
                print(f"n={n} d_c={d_c} W={w}: KR {rep['kr_measured']:.2%} (unexplained {rep['unexplained']:+.1e})",
                      flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"backbone": args.backbone, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
