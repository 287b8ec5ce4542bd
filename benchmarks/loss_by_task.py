"""Where a method's rel. score is lost, task by task (diagnostic; reads `rkv eval` / `rkv pool` JSON).

rel_score = sum_t m_t / sum_t f_t over the tasks where the full cache scores > 0, so

    1 - rel_score = sum_t (f_t - m_t) / sum_t f_t

and each term is one task's share of the loss (negative: the method found more answers there than the
full cache). Two context lengths count different tasks: a task the full cache fails at one length drops
out of its denominator, which is why a 4K figure can read higher than a 2K one for the same codec.

    python benchmarks/loss_by_task.py RUN.json [RUN.json ...] [--methods a,b] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def loss_by_task(rows: list[dict]) -> dict[str, dict]:
    """{"method@context_len": {"rel_score", "counted", "loss": {task: share}}} for every non-full row that
    ran the same samples as the full-cache row."""
    out: dict[str, dict] = {}
    full = {r["context_len"]: r for r in rows if r["method"] == "full"}
    for r in rows:
        if r["method"] == "full" or r["context_len"] not in full:
            continue
        if r.get("n_samples") != full[r["context_len"]].get("n_samples"):
            # a pooled method that ran fewer samples than the full row covers: its rel_score is relative to the
            # full cache on its own samples, which this row does not hold, so the shares would not add up
            print(f"(skipped {r['method']} at {r['context_len']}: {r.get('n_samples')} samples, the full row has "
                  f"{full[r['context_len']].get('n_samples')}; pool it with --methods to match)", file=sys.stderr)
            continue
        ref = full[r["context_len"]]["tasks"]
        counted = [t for t, v in ref.items() if v > 0]
        total = sum(ref[t] for t in counted)
        out[f"{r['method']}@{r['context_len']}"] = {
            "method": r["method"], "context_len": r["context_len"], "rel_score": r["rel_score"],
            "n_samples": r.get("n_samples"), "counted": counted,
            "loss": {t: (ref[t] - r["tasks"].get(t, 0.0)) / total for t in counted} if total else {}}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="rkv eval / rkv pool --json files")
    ap.add_argument("--methods", default=None, help="comma list (default: every method but the full cache)")
    ap.add_argument("--json", default=None, help="also write the decomposition here")
    args = ap.parse_args(argv)
    wanted = {m.strip() for m in args.methods.split(",")} if args.methods else None
    result = {}
    for run in args.runs:
        try:
            rows = json.loads(Path(run).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise SystemExit(f"{run}: not an rkv eval JSON ({err})") from None
        if not isinstance(rows, list) or not all(isinstance(r, dict) and "tasks" in r for r in rows):
            raise SystemExit(f"{run}: expected the list of rows rkv eval writes (each with 'tasks')")
        for key, d in loss_by_task(rows).items():
            if wanted is None or d["method"] in wanted:
                result[f"{run}:{key}"] = d
    for key, d in result.items():
        parts = ", ".join(f"{t} {v:+.3f}" for t, v in sorted(d["loss"].items(), key=lambda kv: -kv[1]))
        print(f"{d['method']} at {d['context_len']} ({d['n_samples']} samples): rel {d['rel_score']:.3f}; "
              f"loss by task: {parts}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
