#!/usr/bin/env bash
# Issue #3/#4 quality benchmark on 2 CPU cores: every method side by side on the same inputs, for the
# trained codec, the L_rec-only ablation codec and ResidualKV† (no codec). Results (JSON rows, CSV,
# markdown, score-vs-KR plot, predictions) land in benchmarks/results/quality/.
#
#   benchmarks/quality_cpu.sh CODEC_DIR [REC_ONLY_CODEC_DIR] [THREADS]
#
# CODEC_DIR comes from (d_c and stride are the backbone YAML's defaults)
#   rkv train --backbone smollm2-135m --init fisher-pca --warmstart-blocks 16 --warmstart-steps 150 \
#             --minutes 55 --lr 2e-4 --rec-reduction mean --seq-len 1024 --threads 1 --out DIR
# and the ablation adds `--loss rec --fisher-alpha 1.0` (no next-token information anywhere: plain
# PCA init, L_rec only). The suite sizes are what fits in about an hour of 2 shared cores: 2 samples
# per synthetic task at 2K, 1 at 4K (the harness's default is 5), perplexity over 3 held-out windows.
# THREADS=1 runs the independent evaluations as parallel jobs of one thread each (faster on 2 cores).
# Each method reads its prompt as it is deployed (residualkv/methods.py): ResidualKV as its codec was
# trained (new_kv: reconstructed), KIVI and ResidualKV† with the prompt's exact KV (new_kv: exact).
set -euo pipefail
CODEC=${1:?usage: benchmarks/quality_cpu.sh CODEC_DIR [REC_ONLY_CODEC_DIR] [THREADS]}
ABLATION=${2:-}
THREADS=${3:-2}
OUT=benchmarks/results/quality
mkdir -p "$OUT"
PY=${PYTHON:-.venv/bin/python}
RKV="$PY -m residualkv.cli"

pids=()
run() {  # one evaluation; in parallel when THREADS=1
  if [ "$THREADS" = 1 ]; then "$@" & pids+=($!); else "$@"; fi
}

# perplexity of held-out text through each cache (2048 tokens prefilled, 64 scored one by one, 3 windows)
run $RKV eval --backbone smollm2-135m --codec "$CODEC" --suite ppl --context-len 2048 --ppl-tokens 64 --ppl-windows 3 \
  --methods full,kivi4,kivi2,snapkv,residualkv-dagger,residualkv-standalone,residualkv-int2,residualkv-r15,omnikv-r15 \
  --threads "$THREADS" --no-progress --json "$OUT/ppl_2k.json"
if [ -n "$ABLATION" ]; then
  run $RKV eval --backbone smollm2-135m --codec "$ABLATION" --suite ppl --context-len 2048 --ppl-tokens 64 --ppl-windows 3 \
    --methods full,residualkv-standalone --threads "$THREADS" --no-progress --json "$OUT/ppl_2k_rec_only.json"
fi
# the synthetic RULER-style suite (the ablation is compared on perplexity only: the suite costs ~1 h per codec)
run $RKV eval --backbone smollm2-135m --codec "$CODEC" --suite synthetic --context-len 2048 --n-samples 2 --ppl-tokens 0 \
  --methods full,kivi2,snapkv,residualkv-dagger,residualkv-standalone,residualkv-r15 \
  --threads "$THREADS" --no-progress --json "$OUT/synthetic_2k.json"
run $RKV eval --backbone smollm2-135m --codec "$CODEC" --suite synthetic --context-len 4096 --n-samples 1 --ppl-tokens 0 \
  --methods full,residualkv-standalone,residualkv-r10 \
  --threads "$THREADS" --no-progress --json "$OUT/synthetic_4k.json"
# 16 more samples per length (seed 1: independent of the sets above): 32 samples at 2K, 24 at 4K
run $RKV eval --backbone smollm2-135m --codec "$CODEC" --suite synthetic --context-len 2048 --n-samples 2 --seed 1 --ppl-tokens 0 \
  --methods full,residualkv-standalone,snapkv,kivi2,residualkv-dagger \
  --threads "$THREADS" --no-progress --json "$OUT/synthetic_2k_seed1.json"
run $RKV eval --backbone smollm2-135m --codec "$CODEC" --suite synthetic --context-len 4096 --n-samples 2 --seed 1 --ppl-tokens 0 \
  --methods full,kivi2,snapkv,residualkv-dagger,residualkv-standalone,residualkv-r10 \
  --threads "$THREADS" --no-progress --json "$OUT/synthetic_4k_seed1.json"
# OmniKV selection on the uncompressed cache at the same CR (issue #4's bytes-at-equal-score comparison)
run $RKV eval --backbone smollm2-135m --codec "$CODEC" --suite synthetic --context-len 2048 --n-samples 2 --ppl-tokens 0 \
  --methods full,omnikv-r15 --threads "$THREADS" --no-progress --json "$OUT/synthetic_2k_omnikv.json"
run $RKV eval --backbone smollm2-135m --codec "$CODEC" --suite synthetic --context-len 4096 --n-samples 1 --ppl-tokens 0 \
  --methods full,omnikv-r10 --threads "$THREADS" --no-progress --json "$OUT/synthetic_4k_omnikv.json"
for p in "${pids[@]}"; do wait "$p"; done  # a failed job fails the script
# every sample of a length in one result (each method relative to the full cache on the samples it ran)
$RKV pool "$OUT"/synthetic_2k{,_seed1,_omnikv}_predictions.jsonl --json "$OUT/synthetic_2k_pooled.json" >/dev/null
$RKV pool "$OUT"/synthetic_4k{,_seed1,_omnikv}_predictions.jsonl --json "$OUT/synthetic_4k_pooled.json" >/dev/null
