#!/usr/bin/env bash
# Before (main at 9fad83a, before issue 42) and after (85f9457, issue 42's cores and layers),
# taking turns, ROUNDS times each benchmark, the order alternating each round; JSON per run in $OUT.
# Each tree's src/ was exported with `git archive <commit> src | tar -x -C /tmp/ab/<old|new>`;
# each run uses its own tree's benchmark harness and package, on the same interpreter.
# Run 2026-11-28 19:13-19:40 UTC: ROUNDS=3 for all four, then OUT=runs2 ROUNDS=4 BENCHES="ddp zero"
# (renumbered 4-7 here). `python3 report.py .` prints report.txt.
set -u
PY=/work/wt/42b/.venv/bin/python
OUT=${OUT:-/tmp/ab/runs}; mkdir -p $OUT
ROUNDS=${ROUNDS:-3}
declare -A ARGS=(
  [allreduce]="--world-size 4 --repeats 30 --largest 16777216"
  [ddp]="--repeats 20 --warmup 3"
  [zero]="--world-sizes 2 4 --repeats 12 --warmup 2"
  [fsdp]="--world-sizes 2 4 --repeats 12 --warmup 2"
)
for r in $(seq 1 $ROUNDS); do
  for bench in ${BENCHES:-ddp zero fsdp allreduce}; do
    if (( r % 2 )); then order="old new"; else order="new old"; fi
    for tree in $order; do
      start=$(date +%s)
      ( cd /tmp && OMP_NUM_THREADS=1 PYTHONPATH=/tmp/ab/$tree/src timeout 1200 $PY -m dpcourse.harness.bench $bench ${ARGS[$bench]} --json $OUT/$bench-$tree-$r.json > $OUT/$bench-$tree-$r.log 2>&1 )
      echo "$bench $tree round $r rc=$? $(( $(date +%s) - start )) s load $(cut -d' ' -f1 /proc/loadavg)" >> $OUT/progress.log
    done
  done
done
echo ALLDONE >> $OUT/progress.log
