"""Does the codec change which tokens OmniKV selects, and are the answer's tokens among them? (diagnostic, CPU)

OmniKV on the FP16 cache keeps the full cache's synthetic score at CR 28-35%, ResidualKV + OmniKV loses
0.1-0.2 against ResidualKV standalone. For one sample of each synthetic task this runs both selections
(`omnikv-rNN` on the FP16 cache, `residualkv-rNN` through the codec) teacher-forced on the same
continuation (the full cache's greedy answer, so every step's history is the same token sequence),
records I_t at every decode step, and reports per task:

  jaccard        |I_codec ∩ I_fp16| / |I_codec ∪ I_fp16|, mean over steps
  answer_recall  share of the prompt's answer tokens (tokens overlapping an answer string) in I_t,
                 mean over steps, for each method
  answer_nll     mean NLL of the full cache's answer tokens, teacher-forced, for each method and for
                 ResidualKV standalone (what the codec costs with every token read)

    python benchmarks/selection_overlap.py CODEC [--context-len 2048] [--ratio 15] [--seed 0] --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from residualkv.backbones import load_backbone  # noqa: E402
from residualkv.codec import ResidualCodec  # noqa: E402
from residualkv.evaluation.harness import build_method_cache, eos_ids, greedy, suite_samples  # noqa: E402
from residualkv.evaluation.samples import encode_prompt, generation_budget, tokenize_prompt  # noqa: E402
from residualkv.evaluation.synthetic import suite_tasks  # noqa: E402
from tasks.common import cache_defaults  # noqa: E402


def answer_positions(tokenizer, sample, n_prompt: int) -> set[int]:
    """Prompt token indices whose characters overlap an occurrence of an answer in the prompt text."""
    text, enc = tokenize_prompt(tokenizer, sample, offsets=True)
    spans = []
    for a in sample.answers:
        start = text.find(a)
        while start >= 0:
            spans.append((start, start + len(a)))
            start = text.find(a, start + 1)
    out = {i for i, (s, e) in enumerate(enc.offset_mapping[:n_prompt]) if any(s < b and e > a for a, b in spans)}
    return out


@torch.no_grad()
def forced(model, cache, prompt: list[int], continuation: list[int]) -> tuple[list[torch.Tensor], float]:
    """Teacher-forced decode; (I_t of every step, mean NLL of `continuation`)."""
    steps: list[torch.Tensor] = []
    ctl = getattr(cache, "sparse", None)
    if ctl is not None:
        choose = ctl.choose

        def recording(h, scores):
            choose(h, scores)
            sel = ctl.selection
            n = ctl.cache.rows.n_slots - 1
            steps.append(torch.arange(n) if sel is None or sel[0] is None else sel[0][0].cpu())
        ctl.choose = recording
    out = model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True, logits_to_keep=1)
    nll, n = 0.0, len(prompt)
    for i, tok in enumerate(continuation):
        nll -= float(torch.log_softmax(out.logits[0, -1].float(), -1)[tok])
        if i + 1 == len(continuation):
            break
        out = model(input_ids=torch.tensor([[tok]]), cache=cache, use_cache=True,
                    position_ids=torch.tensor([[n + i]]))
    return steps, nll / max(len(continuation), 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("codec")
    ap.add_argument("--backbone", default="smollm2-135m")
    ap.add_argument("--context-len", type=int, default=2048)
    ap.add_argument("--ratio", type=int, default=15, help="select NN%% of the history per step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tasks", default=None, help="comma list (default: the synthetic suite)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tok, spec = load_backbone(args.backbone)
    codec = ResidualCodec.load(args.codec, model_config=model.config)
    base = cache_defaults(spec)
    names = args.tasks.split(",") if args.tasks else suite_tasks("synthetic")
    samples = suite_samples("synthetic", tok, args.context_len, 1, args.seed, tasks=names)
    fp16, coded = f"omnikv-r{args.ratio}", f"residualkv-r{args.ratio}"
    rows = []
    for s in samples:
        t0 = time.perf_counter()
        prompt = encode_prompt(tok, s)
        gen = greedy(model, tok, build_method_cache("full", model, codec, base), prompt,
                     generation_budget(tok, s), eos_ids(model, tok))
        cont = gen.token_ids or [int(tok.eos_token_id)]
        where = answer_positions(tok, s, len(prompt))
        sel_f, nll_f = forced(model, build_method_cache(fp16, model, codec, base), prompt, cont)
        sel_c, nll_c = forced(model, build_method_cache(coded, model, codec, base), prompt, cont)
        _, nll_s = forced(model, build_method_cache("residualkv-standalone", model, codec, base), prompt, cont)
        _, nll_full = forced(model, build_method_cache("full", model, codec, base), prompt, cont)
        jac = [len(set(a.tolist()) & set(b.tolist())) / len(set(a.tolist()) | set(b.tolist()))
               for a, b in zip(sel_f, sel_c)]

        def recall(sel):
            return sum(len(where & set(x.tolist())) / len(where) for x in sel) / len(sel) if where and sel else None

        row = {"id": s.id, "task": s.task, "answers": s.answers, "full_answer": gen.text, "steps": len(sel_c),
               "selected_per_step": int(sel_c[0].numel()) if sel_c else None, "answer_tokens": len(where),
               "jaccard": sum(jac) / len(jac) if jac else None,
               "answer_recall": {fp16: recall(sel_f), coded: recall(sel_c)},
               "answer_nll": {"full": nll_full, fp16: nll_f, "residualkv-standalone": nll_s, coded: nll_c},
               "seconds": time.perf_counter() - t0}
        rows.append(row)
        print(json.dumps({k: row[k] for k in ("task", "jaccard", "answer_recall", "answer_nll")}, default=str), flush=True)
    result = {"codec": args.codec, "context_len": args.context_len, "ratio": args.ratio, "seed": args.seed,
              "threads": torch.get_num_threads(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
