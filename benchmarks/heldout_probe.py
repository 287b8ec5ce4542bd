"""Codecs side by side on held-out text and on a recall probe (SmolLM2-135M, CPU, teacher-forced).

For each codec: next-token loss of held-out blocks of the training corpus through the compressed cache,
read as the codec was trained (standalone, every token reconstructed; or, for a codec trained with
`--reading served`, the second half of each block scored through the first half's compressed history,
`eval/scored_from`), against the full cache on the same tokens, and the same on a recall probe, the
blocks with copies of their own earlier text (4 spans of 24 tokens), scored only on the copied tokens a
model can predict by looking the source up. The text metric says whether a codec keeps language
modelling; the KL (full cache -> codec, per token, on the text) whether it keeps the model saying what
it said; the recall one whether it keeps the exact look-ups retrieval tasks make. Both come from
`residualkv.training.trainer.heldout_metrics`, which `rkv train` also reports at the end of a run.

    python benchmarks/heldout_probe.py DIR_A/codec DIR_B/codec ... [--blocks 8] [--seq-len 1024]

Writes benchmarks/results/heldout_probe.json (a row per codec).
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
from residualkv.codec import ResidualCodec  # noqa: E402
from residualkv.training.packing import pack_documents, resolve_source  # noqa: E402
from residualkv.training.trainer import heldout_losses, heldout_metrics  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("codecs", nargs="+", help="saved codec directories")
    ap.add_argument("--backbone", default="smollm2-135m")
    ap.add_argument("--blocks", type=int, default=8, help="held-out blocks (the first N, as rkv train scores)")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "heldout_probe.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer, _ = load_backbone(args.backbone)
    packed = pack_documents(resolve_source("offline"), tokenizer, args.seq_len)
    blocks = torch.tensor(packed.heldout.select(range(min(args.blocks, len(packed.heldout))))["input_ids"])
    rows = []
    full = heldout_losses(model, blocks)  # the full cache on the recall probe: once, the same for every codec
    for path in args.codecs:
        codec = ResidualCodec.load(path, model.config)
        t0 = time.perf_counter()
        m = heldout_metrics(model, codec, blocks, full=full)
        training = codec.extra.get("training", {})
        rows.append({"codec": str(path), "d_c": codec.dims.d_c, "stride": codec.config.stride,
                     "init": training.get("init"), "init_from": training.get("init_from"),
                     "recall_spans": training.get("recall_spans", 0), "train_tokens": training.get("tokens"),
                     **{k.removeprefix("eval/"): v for k, v in m.items()}, "seconds": round(time.perf_counter() - t0, 1)})
        r = rows[-1]
        print(f"{path}: text x{r['ppl_ratio']:.4f} ({r['ntp_codec']:.4f} vs {r['ntp_full']:.4f}), "
              f"KL from the full cache {r['kl']:.4f}, recall "
              f"x{r.get('recall_ppl_ratio', float('nan')):.4f} ({r.get('recall_nll_codec', float('nan')):.4f} vs "
              f"{r.get('recall_nll_full', float('nan')):.4f})", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"backbone": args.backbone, "blocks": len(blocks), "seq_len": args.seq_len,
                               "torch": torch.__version__, "machine": platform.machine(),
                               "cpu_threads": torch.get_num_threads(), "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
