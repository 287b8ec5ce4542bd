#!/usr/bin/env bash
# One trained codec against the default one, on the sample sets every codec comparison in BENCHMARKS.md
# uses since "A continuous reading": the synthetic suite at 2K (seed 0, and seed 1 split in two halves:
# 32 samples) and the seed-1 subset at 4K that the full cache answers (10 samples), ResidualKV standalone
# only; the full cache's rows are reused from the committed runs, so only the codec's rows are computed.
# Then `rkv pool` compares it with the default codec's rows on the same samples (string match and the
# paired answer NLL, 95% intervals). The default's rows predate the 2026-12-06 change of vt's and kv
# retrieval's gold answers, so the answer NLL pairs leave those two tasks out (24 of 32 samples at 2K, 8 of 10 at 4K).
#
#   benchmarks/codec_vs_default.sh CODEC_DIR NAME [OUT_DIR]
#
# Two one-thread lanes side by side on the 2 cores, about 9.5 minutes (14.6 with ALL_4K, both measured 2026-12-06). Writes OUT_DIR (default
# benchmarks/results/codecs/NAME)/NAME_{2k_seed0,2k_seed1_a,2k_seed1_b,4k_seed1}.* and NAME_{2k,4k}_pooled.*
#
# ALL_4K=1 also runs the other 4K sample sets of "Retraining the default codec" (seed 0: 8 samples, seed 2:
# 16), so that 4K compares over 34 samples: one run of a recipe at 4K can sit 0.1-0.3 nats/token from
# another, and 10 samples rank little. Adds NAME_4k_seed{0,2_a,2_b}.*
# and NAME_4k_34_pooled.* (against the retrained default's rows, which carry string match only).
set -euo pipefail
CODEC=${1:?usage: benchmarks/codec_vs_default.sh CODEC_DIR NAME [OUT_DIR]}
NAME=${2:?usage: benchmarks/codec_vs_default.sh CODEC_DIR NAME [OUT_DIR]}
OUT=${3:-benchmarks/results/codecs/$NAME}
A=benchmarks/results/answer_nll  # the default codec's and the full cache's committed rows
R=benchmarks/results/retrained   # the retrained default's rows on the other 4K sample sets
# the full cache's answers on all these samples, with the prompt hash that lets rkv eval reuse them (the rows in
# A and R predate it): run again 2026-12-06, every generation identical to the committed ones
F=benchmarks/results/full_cache
PY=${PYTHON:-.venv/bin/python}
RKV="$PY -m residualkv.cli"
[ -f "$CODEC/codec/codec.json" ] && CODEC=$CODEC/codec
mkdir -p "$OUT"

common=(--backbone smollm2-135m --codec "$CODEC" --suite synthetic --n-samples 2 --ppl-tokens 0
        --methods full,residualkv-standalone --threads 1 --no-progress)
lane1() {
  $RKV eval "${common[@]}" --context-len 2048 --seed 0 --full-from $F/full_2k_seed0_predictions.jsonl \
    --json "$OUT/${NAME}_2k_seed0.json"
  $RKV eval "${common[@]}" --context-len 4096 --seed 1 --synthetic-tasks niah_single,niah_multikey,niah_multivalue,vt,fwe \
    --full-from $F/full_4k_seed1_predictions.jsonl --json "$OUT/${NAME}_4k_seed1.json"
  if [ -n "${ALL_4K:-}" ]; then
    $RKV eval "${common[@]}" --context-len 4096 --seed 0 --n-samples 1 \
      --full-from $F/full_4k_seed0_predictions.jsonl --json "$OUT/${NAME}_4k_seed0.json"
  fi
}
lane2() {
  $RKV eval "${common[@]}" --context-len 2048 --seed 1 --synthetic-tasks niah_single,niah_multikey,niah_multivalue,niah_multiquery \
    --full-from $F/full_2k_seed1_a_predictions.jsonl --json "$OUT/${NAME}_2k_seed1_a.json"
  $RKV eval "${common[@]}" --context-len 2048 --seed 1 --synthetic-tasks vt,cwe,fwe,kv_retrieval \
    --full-from $F/full_2k_seed1_b_predictions.jsonl --json "$OUT/${NAME}_2k_seed1_b.json"
  if [ -n "${ALL_4K:-}" ]; then
    $RKV eval "${common[@]}" --context-len 4096 --seed 2 --synthetic-tasks niah_single,niah_multikey,niah_multivalue,niah_multiquery \
      --full-from $F/full_4k_seed2_a_predictions.jsonl --json "$OUT/${NAME}_4k_seed2_a.json"
    $RKV eval "${common[@]}" --context-len 4096 --seed 2 --synthetic-tasks vt,cwe,fwe,kv_retrieval \
      --full-from $F/full_4k_seed2_b_predictions.jsonl --json "$OUT/${NAME}_4k_seed2_b.json"
  fi
}
lane1 > "$OUT/${NAME}_lane1.log" 2>&1 & p1=$!
lane2 > "$OUT/${NAME}_lane2.log" 2>&1 & p2=$!
wait $p1 || { echo "lane 1 failed, see $OUT/${NAME}_lane1.log" >&2; exit 1; }
wait $p2 || { echo "lane 2 failed, see $OUT/${NAME}_lane2.log" >&2; exit 1; }
rm -f "$OUT/${NAME}_lane1.log" "$OUT/${NAME}_lane2.log"  # progress bars only, once both lanes passed

default=residualkv-standalone
$RKV pool $A/groups_2k_seed0_a_predictions.jsonl:full,$default $A/groups_2k_seed1_{a,b}_predictions.jsonl:full,$default \
  "$OUT/${NAME}_2k_seed0_predictions.jsonl:$default=$NAME" "$OUT/${NAME}_2k_seed1_a_predictions.jsonl:$default=$NAME" \
  "$OUT/${NAME}_2k_seed1_b_predictions.jsonl:$default=$NAME" --compare "$NAME,$default" --json "$OUT/${NAME}_2k_pooled.json"
$RKV pool $A/groups_4k_seed1_a_predictions.jsonl:full,$default "$OUT/${NAME}_4k_seed1_predictions.jsonl:$default=$NAME" \
  --compare "$NAME,$default" --json "$OUT/${NAME}_4k_pooled.json"
if [ -n "${ALL_4K:-}" ]; then
  $RKV pool $R/synthetic_4k_seed{0,1,2_a,2_b}_predictions.jsonl:full,$default \
    "$OUT/${NAME}_4k_seed"{0,1,2_a,2_b}"_predictions.jsonl:$default=$NAME" \
    --compare "$NAME,$default" --json "$OUT/${NAME}_4k_34_pooled.json"
fi
