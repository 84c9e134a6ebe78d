#!/usr/bin/env bash
# `make gpu-check`: what only a machine with GPUs can check, in one command that fits in
# 9 minutes on one H100.
#   1. the tests marked gpu / multigpu (they skip elsewhere);
#   2. every notebook under nbval on CUDA: NCCL where every rank has a GPU of its own, gloo with
#      CUDA tensors where ranks share one (dpcourse.runtime.choose_backend decides);
#   3. the allreduce, ddp and zero benchmarks, written to benchmarks/<gpu-name>-<count>/ with the
#      machine, date and command in each file (commit them: benchmarks/README.md lists them).
# Without a GPU it says so and exits 1. BIN is the virtual environment's bin folder.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
start=$(date +%s)

gpus=$("$BIN/python" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')
if [[ ${gpus:-0} -lt 1 ]]; then
  echo "make gpu-check needs a CUDA GPU, and torch sees none on this machine" \
       "(torch.cuda.is_available() is False): run it where \`nvidia-smi\` lists a GPU."
  exit 1
fi
name=$("$BIN/python" -c 'import re, torch; print(re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(0).lower()).strip("-"))')
out="benchmarks/$name-$gpus"
mkdir -p "$out"
echo "gpu-check on $gpus x $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1): results in $out/"

failed=""
step() {  # step NAME SECONDS COMMAND...: run it with a time limit, note a failure, go on
  local what=$1 limit=$2
  shift 2
  local t0=$(date +%s)
  echo "== $what (at most ${limit} s)"
  timeout --kill-after=10 "$limit" "$@" || failed="$failed $what"
  echo "== $what took $(( $(date +%s) - t0 )) s"
}

step gpu-tests 120 "$BIN/python" -m pytest -m "gpu or multigpu" -rs -q tests
step notebooks 300 "$BIN/python" -m pytest chapters --nbval-lax --nbval-current-env \
  --nbval-cell-timeout=120 --executed-dir=_build/executed-gpu -q
ranks=$(( gpus >= 2 ? gpus : 2 ))
step bench-allreduce 60 "$BIN/python" -m dpcourse.bench allreduce --world-size "$ranks" \
  --json "$out/allreduce-$ranks.json"
step bench-ddp 60 "$BIN/python" -m dpcourse.bench ddp --world-size "$ranks" --repeats 20 \
  --json "$out/ddp.json"
step bench-zero 60 "$BIN/python" -m dpcourse.bench zero --world-sizes "$ranks" --repeats 10 \
  --json "$out/zero.json"

echo "gpu-check took $(( $(date +%s) - start )) s"
if [[ -n $failed ]]; then
  echo "gpu-check failed:$failed"
  exit 1
fi
