"""Reconstruction error of answer tokens vs the rest of a synthetic prompt (diagnostic, CPU).

For one sample of each synthetic task, every coded token of the prompt is put in one of two classes:
`answer` (a token whose text is part of an answer: the needle's digits, a UUID's characters) and
`other` (haystack, instructions, keys). Per class and per half (keys, values), mean over coded layers:

  refs_alone  ‖x − mean of its k references‖² / ‖x‖²  (what the references leave to the codec)
  stored      ‖x̂ − x‖² / ‖x‖² through the codec's INT4 write path

and the share of answer tokens among the top `--top` of coded tokens by reference residual (what a
rule "store the worst-predicted tokens exact" would catch; `kv_half_probe.py outliers:P` measures its
score). Writes JSON:

    python benchmarks/token_error_by_class.py CODEC [--context-len 2048] [--top 0.03] --out OUT.json
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
from residualkv.codec import ResidualCodec  # noqa: E402
from residualkv.evaluation.samples import encode_prompt  # noqa: E402
from residualkv.evaluation.synthetic import SyntheticGenerator, get_task  # noqa: E402
from residualkv.quant import dequantize, quantize  # noqa: E402
from residualkv.schedule import ReferenceSchedule  # noqa: E402
from residualkv.training.warmstart import capture_kv, residual_pairs  # noqa: E402

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "kv_retrieval")


def answer_mask(pieces: list[str], answers: list[str]) -> torch.Tensor:
    chars = set("".join(answers))
    return torch.tensor([bool(p) and set(p) <= chars and any(p in a for a in answers) for p in pieces])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("codec")
    ap.add_argument("--backbone", default="smollm2-135m")
    ap.add_argument("--context-len", type=int, default=2048)
    ap.add_argument("--top", type=float, default=0.03)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    model, tok, _ = load_backbone(args.backbone)
    codec = ResidualCodec.load(args.codec, model.config)
    cfg = codec.config
    gen = SyntheticGenerator(tok, seed=args.seed)
    results = {}
    for task in TASKS:
        sample = gen.sample(task, args.context_len, 0)
        ids = torch.tensor(encode_prompt(tok, sample))[None]
        is_ref = ReferenceSchedule(cfg.n_sink, cfg.stride, cfg.stride_alpha).is_ref(0, ids.shape[1])
        coded = (~is_ref).nonzero().flatten().tolist()
        is_answer = answer_mask([tok.decode([ids[0, i]]).strip() for i in coded], list(sample.answers))
        kv = capture_kv(model, ids, codec.layer_ids)
        acc: dict[str, list[float]] = {}
        for li in codec.layer_ids:
            x, mean = residual_pairs(kv[li], cfg)
            layer = codec.layer(li)
            with torch.no_grad():
                z = layer.encode(x, mean).float()
                x_hat = layer.decode(dequantize(quantize(z, cfg.bits, cfg.group_size), cfg.bits, cfg.group_size)) + mean
            h = x.shape[-1] // 2
            for half, sl in (("keys", slice(0, h)), ("values", slice(h, None))):
                energy = x[:, sl].pow(2).sum(-1)
                stored = (x_hat[:, sl] - x[:, sl]).pow(2).sum(-1) / energy
                alone = (mean[:, sl] - x[:, sl]).pow(2).sum(-1) / energy
                for cls, m in (("answer", is_answer), ("other", ~is_answer)):
                    if bool(m.any()):
                        acc.setdefault(f"{half}/{cls}/stored", []).append(float(stored[m].mean()))
                        acc.setdefault(f"{half}/{cls}/refs_alone", []).append(float(alone[m].mean()))
            resid = (x - mean).pow(2).sum(-1)
            top = resid >= torch.quantile(resid, 1 - args.top)
            acc.setdefault("answer_tokens_in_top", []).append(float((top & is_answer).sum() / max(1, int(is_answer.sum()))))
        row = {k: round(sum(v) / len(v), 4) for k, v in acc.items()}
        row.update(haystack=get_task(task).params.get("haystack"), n_answer_tokens=int(is_answer.sum()),
                   n_coded=len(coded))
        results[task] = row
        print(task, json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"codec": args.codec, "context_len": args.context_len, "top": args.top,
                                          "tasks": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
