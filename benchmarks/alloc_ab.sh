#!/usr/bin/env bash
# Does the memory allocator change a training step's time? The same short `rkv train` (2 threads;
# 4096-token blocks in bf16 showed ~25% system time and ~10^5 minor page faults/s on an AMX machine) under
# glibc's malloc, jemalloc and tcmalloc (LD_PRELOAD), one after another, in two rounds with the order
# reversed so that drift of the machine does not pass for an allocator effect. Prints the median step
# time of each run (the first step, which allocates everything once, is left out) and writes
# OUT/alloc_ab.json.
#
#   benchmarks/alloc_ab.sh [OUT] [STEPS] [SEQ_LEN]   # BF16=1 adds --bf16 (only where the CPU has AMX/AVX512-BF16)
#   # Debian: apt-get install libjemalloc2 libtcmalloc-minimal4
#
# Run it alone on the machine: it is a timing.
set -euo pipefail
OUT=${1:-/tmp/rkv-alloc-ab}
STEPS=${2:-6}
SEQ_LEN=${3:-1024}
BF16=${BF16:+--bf16}
PY=${PYTHON:-.venv/bin/python}
LIB=/usr/lib/x86_64-linux-gnu
declare -A PRELOAD=([glibc]="" [jemalloc]="$LIB/libjemalloc.so.2" [tcmalloc]="$LIB/libtcmalloc_minimal.so.4")
for a in jemalloc tcmalloc; do
  [ -f "${PRELOAD[$a]}" ] || { echo "missing ${PRELOAD[$a]}: apt-get install libjemalloc2 libtcmalloc-minimal4" >&2; exit 1; }
done
mkdir -p "$OUT"
run() {  # $1 allocator, $2 round
  local dir="$OUT/$1-$2"
  rm -rf "$dir"
  echo "[alloc_ab] round $2: $1" >&2
  LD_PRELOAD="${PRELOAD[$1]}" /usr/bin/time -f '%e s wall, %S s sys, %R minor faults' -o "$dir.time" \
    $PY -m residualkv.cli train --backbone smollm2-135m --init default --steps "$STEPS" --seq-len "$SEQ_LEN" \
      --threads 2 $BF16 --lr 2e-4 --rec-reduction mean --log-every 1 --eval-blocks 1 --ckpt-every 1000 \
      --out "$dir" > "$dir.log" 2>&1
}
for a in glibc jemalloc tcmalloc; do run $a 1; done
for a in tcmalloc jemalloc glibc; do run $a 2; done
$PY - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
res = {}
for a in ("glibc", "jemalloc", "tcmalloc"):
    steps = []
    for r in (1, 2):
        rows = [json.loads(l) for l in (out / f"{a}-{r}" / "metrics.jsonl").read_text().splitlines()]
        steps += [m["step_seconds"] for m in rows if "step_seconds" in m and m["step"] > 1]
    res[a] = {"median_step_seconds": statistics.median(steps), "steps": steps,
              "time": [(out / f"{a}-{r}.time").read_text().strip() for r in (1, 2)]}
base = res["glibc"]["median_step_seconds"]
for a, r in res.items():
    r["speedup_vs_glibc"] = base / r["median_step_seconds"]
    print(f"{a:9s} median step {r['median_step_seconds']:.2f} s  x{r['speedup_vs_glibc']:.2f} vs glibc  | {' | '.join(r['time'])}")
(out / "alloc_ab.json").write_text(json.dumps(res, indent=1))
PY
