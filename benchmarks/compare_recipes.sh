#!/usr/bin/env bash
# The training recipes of "Recipes compared over their training runs" (BENCHMARKS.md), each over all its runs:
# 2048- against 1024-token blocks, and the 2048-token variants (the same 179 steps in bf16; bf16 over two epochs;
# bf16 over the offline corpus plus packages' docstrings; the bf16 one at lr 6e-4 and 1e-4), and 4096-token blocks
# in bf16, at 2K (32 samples) and 4K (34), from the rows codec_vs_default.sh wrote for each run (ALL_4K=1 for
# the 4K ones). Only `rkv pool`: a few seconds, nothing is generated again.
#
#   benchmarks/compare_recipes.sh [OUT_DIR]
#
# Writes OUT_DIR (default benchmarks/results/codecs/recipes)/recipes_{2k,4k}{.json,_recipes.json,...}.
# A run joins a recipe by its NAME below; a run without its rows here is an error, not a smaller recipe.
set -euo pipefail
OUT=${1:-benchmarks/results/codecs/recipes}
PY=${PYTHON:-.venv/bin/python}
RKV="$PY -m residualkv.cli"
C=benchmarks/results/codecs
A=benchmarks/results/answer_nll  # the default codec's rows (Intel, 2026-12-01/03) at 2K
R=benchmarks/results/retrained   # the default recipe retrained on the Intel machine, the 34 4K samples
s=residualkv-standalone
L2048=(L2048amd L2048s1 L2048s2)
L2048BF=(L2048bf)  # bf16, planned from the time budget: 357 steps, 2 epochs (one run so far)
L2048PKG=(L2048pkg)  # bf16, 357 steps over the offline corpus plus as much packages' docstrings: 1 epoch
L2048BF179=(L2048bf179 L2048bf179s1 L2048bf179s2)  # the fp32 recipe's 179 steps in bf16 (data order seeds 0, 1, 2)
L4096BF=(L4096full)  # 4096-token blocks in bf16, 187 steps, the schedule run out past the hour (one run so far)
L2048LR6=(L2048lr6)  # L2048bf179 at lr 6e-4 (3x the paper's), data order seed 0 (one run)
L2048LR1=(L2048lr1 L2048lr1s1 L2048lr1s2)  # L2048bf179 at lr 1e-4 (half the paper's), data order seeds 0, 1, 2
L2048LR05=(L2048lr05 L2048lr05s1)  # L2048bf179 at lr 5e-5 (a quarter of the paper's), data order seeds 0, 1
L1024AMD_2K=(L1024r3 L1024s1r L1024s2r L1024t1)
L1024AMD_4K=(L1024r3 L1024s1r L1024s2r)  # L1024t1 ran only the 10 seed-1 samples at 4K
join() { local IFS=,; echo "$*"; }
runs() {  # runs CTX SETS NAME...: each run's prediction files, its method renamed to the run
  local ctx=$1 sets=$2; shift 2
  for n in "$@"; do for set in $sets; do
    local f=$C/$n/${n}_${ctx}_${set}_predictions.jsonl
    [ -f "$f" ] || { echo "missing $f: score $n with benchmarks/codec_vs_default.sh (ALL_4K=1 for 4K)" >&2; exit 1; }
    echo "$f:$s=$n"
  done; done
}
mkdir -p "$OUT"

# The 2048-token recipe's variants and the 4096-token run, compared the same way at both lengths.
LONG_RUNS=("${L2048[@]}" "${L2048BF[@]}" "${L2048PKG[@]}" "${L2048BF179[@]}" "${L4096BF[@]}" "${L2048LR6[@]}" "${L2048LR1[@]}" "${L2048LR05[@]}")
variants=(--recipe "L2048bf=$(join "${L2048BF[@]}")" --recipe "L2048pkg=$(join "${L2048PKG[@]}")"
          --recipe "L2048bf179=$(join "${L2048BF179[@]}")" --recipe "L4096bf=$(join "${L4096BF[@]}")"
          --recipe "lr6e-4=$(join "${L2048LR6[@]}")" --recipe "lr1e-4=$(join "${L2048LR1[@]}")"
          --recipe "lr5e-5=$(join "${L2048LR05[@]}")" --compare-recipes lr5e-5,L2048bf179 --compare-recipes lr5e-5,lr1e-4
          --compare-recipes lr6e-4,L2048bf179 --compare-recipes lr1e-4,L2048bf179 --compare-recipes lr6e-4,lr1e-4
          --compare-recipes L2048bf,L2048 --compare-recipes L2048pkg,L2048bf --compare-recipes L2048pkg,L2048
          --compare-recipes L2048bf179,L2048 --compare-recipes L4096bf,L2048bf179 --compare-recipes L4096bf,L2048)

files_2k=$(runs 2k "seed0 seed1_a seed1_b" "${LONG_RUNS[@]}" "${L1024AMD_2K[@]}")
# shellcheck disable=SC2086  # one file argument per line of $files_2k
$RKV pool $A/groups_2k_seed0_a_predictions.jsonl:full,$s=default $A/groups_2k_seed1_{a,b}_predictions.jsonl:full,$s=default \
  $files_2k \
  --recipe "L2048=$(join "${L2048[@]}")" --recipe "L1024=default,$(join "${L1024AMD_2K[@]}")" \
  --recipe "L1024amd=$(join "${L1024AMD_2K[@]}")" \
  --compare-recipes L2048,L1024 --compare-recipes L2048,L1024amd "${variants[@]}" \
  --json "$OUT/recipes_2k.json"

files_4k=$(runs 4k "seed0 seed1 seed2_a seed2_b" "${LONG_RUNS[@]}" "${L1024AMD_4K[@]}")
# shellcheck disable=SC2086
$RKV pool $R/synthetic_4k_seed{0,1,2_a,2_b}_predictions.jsonl:full,$s=retrained \
  $files_4k \
  --recipe "L2048=$(join "${L2048[@]}")" --recipe "L1024amd=$(join "${L1024AMD_4K[@]}")" \
  --recipe "L1024=retrained,$(join "${L1024AMD_4K[@]}")" \
  --compare-recipes L2048,L1024amd --compare-recipes L2048,L1024 "${variants[@]}" \
  --json "$OUT/recipes_4k.json"
