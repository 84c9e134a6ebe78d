#!/usr/bin/env bash
# `make gpu-check` (or `bash tools/gpu_check.sh`): what only a machine with GPUs can check, in one
# command that fits in about 8 minutes on one GPU and 16 cores, also on a machine with no network
# whose image already has torch.
#
# The interpreter: PYTHON_FOR_GPU if set; else the virtual environment's (BIN, default .venv/bin)
# if there is one; else this machine's python3, used as it is, if it imports torch 2.11 to 2.13 (no
# venv is made and nothing comes from the network). What that interpreter lacks (nbval, Jupyter's
# kernel, ...) is installed from a folder of wheels (WHEELS, default .gpu/whl) into a folder of its
# own (GPU_CHECK_SITE) put on PYTHONPATH, with src/ (the package is not installed).
#
# The steps, each with a time limit (cut to what is left of GPU_CHECK_BUDGET seconds; a step that
# finds less than 20 s left is skipped) and its output kept in <results>/<step>.log:
#   environment  nvidia-smi, Python, torch, CUDA, NCCL, GPUs, date, commit, this command
#   gpu-tests    pytest -m "gpu or multigpu" tests
#   notebooks    every notebook under nbval on CUDA, NOTEBOOK_JOBS at a time (default 3), each
#                kernel keeping at most KEEP_RANKS pools of ranks (default 2); a notebook's ranks
#                end with its kernel (nbval shuts each kernel down after its notebook)
#   unit-tests   only with GPU_UNIT=1 (after the notebooks) or GPU_UNIT=parallel (beside them where
#                the GPU and the host have the memory, else after them): the unit tests but the
#                gpu ones and the website's, on UNIT_JOBS workers (default 4)
#   bench-allreduce, bench-ddp, bench-zero, bench-fsdp-streams, bench-fsdp-offload   the
#                benchmarks, as JSON files with machine, date, command (fsdp_streams: chapter 9's
#                profiled step, NCCL's kernels on rows of their own; fsdp_offload: chapter 11's
#                CPU offload, ours and fully_shard's, GPU and host memory and step time, on one
#                rank with NCCL where there is one GPU)
# What only a GPU can show of FSDP (issue 41) is in gpu-tests: tests/test_fsdp.py's peak of
# torch.cuda.max_memory_allocated on 16 slow layers (the host running ahead must not make FSDP
# hold more layers: memory freed by the streams' order, no record_stream) and
# tests/test_fsdp_offload.py's model states off the GPU with CPUOffloadPolicy, ours and torch's.
# Results: benchmarks/<gpu-name>-<count>/ (GPU_CHECK_RESULTS to change it): the benchmarks' JSON
# files, environment.txt, a log per step, notebook-reports/ (each failing notebook's tracebacks)
# and summary.md / summary.json (per step: status, passed/failed counts from pytest's last line,
# seconds, the failing tests and cells). GPU_CHECK_OUT=DIR copies the summaries, the environment,
# the JSON files and gpu-check-logs.tar.gz (every log) to DIR after every step: at most 8 files.
# GPU_CHECK_COMMIT names the commit where the checkout has no .git. Without a GPU it says so and
# exits 1; it exits 1 when any step did not pass.
# GPU_CHECK_DRY_RUN=1 prints each step's command instead of running it (and pretends to see
# GPU_CHECK_DRY_RUN_GPUS GPUs, default 1; results under _build/gpu-check-dry-run/).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
root=$PWD
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # nproc follows OMP_NUM_THREADS
start=$(date +%s)

knobs=()  # the settings given, for the record of the command line
for var in PYTHON_FOR_GPU BIN WHEELS GPU_CHECK_SITE GPU_CHECK_BUDGET GPU_CHECK_RESULTS GPU_CHECK_OUT \
  GPU_CHECK_COMMIT \
  GPU_CHECK_DRY_RUN GPU_CHECK_DRY_RUN_GPUS GPU_UNIT UNIT_JOBS NOTEBOOK_JOBS KEEP_RANKS CELL_TIMEOUT \
  THREADS GPU_TESTS_TIMEOUT NOTEBOOKS_TIMEOUT UNIT_TIMEOUT BENCH_TIMEOUT GPU_UNIT_PARALLEL_GIB; do
  [[ -n ${!var:-} ]] && knobs+=("$var=${!var}")
done
command_line="${knobs[*]:+${knobs[*]} }$(if [[ -n ${MAKELEVEL:-} ]]; then echo make gpu-check
  else echo "bash tools/gpu_check.sh${*:+ $*}"; fi)"

dry=${GPU_CHECK_DRY_RUN:-0}
[[ $dry == 0 ]] && dry=""
BIN=${BIN:-.venv/bin}
WHEELS=${WHEELS:-.gpu/whl}
GPU_UNIT=${GPU_UNIT:-0}
[[ $GPU_UNIT == 0 ]] && GPU_UNIT=""
NOTEBOOK_JOBS=${NOTEBOOK_JOBS:-3}
UNIT_JOBS=${UNIT_JOBS:-4}
KEEP_RANKS=${KEEP_RANKS:-2}
CELL_TIMEOUT=${CELL_TIMEOUT:-120}
THREADS=${THREADS-1}
GPU_TESTS_TIMEOUT=${GPU_TESTS_TIMEOUT:-150}
NOTEBOOKS_TIMEOUT=${NOTEBOOKS_TIMEOUT:-330}
UNIT_TIMEOUT=${UNIT_TIMEOUT:-400}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-60}
case $GPU_UNIT in
  "" | 1 | parallel) ;;
  *) echo "GPU_UNIT must be 0 (no unit tests), 1 (after the notebooks) or parallel, got $GPU_UNIT"
     exit 2 ;;
esac
# The time budget: about 8 minutes, 9 with the unit tests beside the notebooks, and the unit
# tests' limit on top where they run after them.
budget_for() { case $1 in 1) echo $(( 480 + UNIT_TIMEOUT )) ;; parallel) echo 540 ;; *) echo 480 ;; esac; }
budget=${GPU_CHECK_BUDGET:-$(budget_for "$GPU_UNIT")}
if [[ -n ${GPU_CHECK_OUT:-} ]]; then
  mkdir -p "$GPU_CHECK_OUT" && GPU_CHECK_OUT=$(cd "$GPU_CHECK_OUT" && pwd) || exit 2
fi

# --- The interpreter: PYTHON_FOR_GPU, the venv's, or the machine's own python3 with its torch.
if [[ -n ${PYTHON_FOR_GPU:-} ]]; then
  py=$PYTHON_FOR_GPU; origin="PYTHON_FOR_GPU"
elif [[ -x $BIN/python ]]; then
  py=$BIN/python; origin="the virtual environment $BIN"
else
  py=$(command -v python3 || echo python3); origin="this machine's python3 (no virtual environment at $BIN)"
fi
# One look at torch: its version, whether the course supports it, the GPUs, the first one's name.
probe=$("$py" -c 'import torch
v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
try:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    name = torch.cuda.get_device_name(0) if n else ""
except Exception as exc:
    print("gpu-check: torch cannot use CUDA here:", exc, file=__import__("sys").stderr)
    n, name = 0, ""
print(torch.__version__, int((2, 11) <= v <= (2, 13)), n, name)')
read -r torch_version supported gpus gpu_name <<< "$probe"
if [[ -z $torch_version ]]; then
  echo "gpu-check: $py ($origin) cannot import torch. Run \`make setup\` first (it makes .venv from"
  echo "requirements.txt, which needs the network), or name an interpreter that has torch 2.11 to"
  echo "2.13: PYTHON_FOR_GPU=/path/to/python make gpu-check."
  exit 1
fi
if [[ $supported != 1 ]]; then
  if [[ $origin == this* ]]; then
    echo "gpu-check: $py has torch $torch_version; the course supports 2.11 to 2.13. Run \`make setup\`"
    echo "(a .venv with the pinned torch, needs the network), or PYTHON_FOR_GPU=$py to use it anyway."
    exit 1
  fi
  echo "gpu-check: warning: torch $torch_version at $py is outside the supported 2.11 to 2.13"
fi
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}"
if [[ -n $THREADS ]]; then export OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS; fi

# --- The GPUs.
if [[ -n $dry ]]; then
  gpus=${GPU_CHECK_DRY_RUN_GPUS:-1}; gpu_name="dry run"
elif [[ ${gpus:-0} -lt 1 ]]; then
  echo "make gpu-check needs a CUDA GPU, and torch sees none on this machine" \
       "(torch.cuda.is_available() is False with torch $torch_version at $py): run it where" \
       "\`nvidia-smi\` lists a GPU."
  exit 1
fi
slug=$(LC_ALL=C tr '[:upper:]' '[:lower:]' <<< "$gpu_name" | sed -E 's/[^a-z0-9]+/-/g; s/^-+|-+$//g')
if [[ -n $dry ]]; then out=${GPU_CHECK_RESULTS:-_build/gpu-check-dry-run/$slug-$gpus}
else out=${GPU_CHECK_RESULTS:-benchmarks/$slug-$gpus}; fi
mkdir -p "$out"
rm -rf "$out"/*.log "$out"/summary.md "$out"/summary.json "$out"/environment.txt \
  "$out"/notebook-reports
steps=$(mktemp)  # a line per step: name, status, exit code, seconds, limit, note
trap 'rm -f "$steps"' EXIT
commit=${GPU_CHECK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
date_utc=$(date -u +%Y-%m-%dT%H:%M:%SZ)
machine="$gpus x $gpu_name, $cores CPU cores, host $(hostname)"
echo "gpu-check on $machine, with $py (torch $torch_version, $origin)"
echo "results in $out/; time budget $budget s${dry:+; DRY RUN: commands are printed, not run}"

# --- What the interpreter lacks, from the folder of wheels.
needed="pytest pytest_timeout xdist hypothesis cloudpickle numpy matplotlib nbval nbformat nbclient
  ipykernel ipywidgets"
missing() {
  # shellcheck disable=SC2086
  "$py" -c 'import importlib.util as u, sys; print(" ".join(m for m in sys.argv[1:] if u.find_spec(m) is None))' \
    $needed
}
lacking=$(missing)
if [[ -n $lacking ]] && compgen -G "$WHEELS/*.whl" > /dev/null; then
  site=${GPU_CHECK_SITE:-${TMPDIR:-/tmp}/dpcourse-gpu-site}
  listing=$(cd "$WHEELS" && ls -- *.whl)
  if [[ -f $site/.dpcourse-wheels && $(cat "$site/.dpcourse-wheels") == "$listing" ]]; then
    echo "using the wheels installed earlier in $site"
  else
    echo "installing $(wc -l <<< "$listing") wheels from $WHEELS into $site (this machine lacks: $lacking)"
    if "$py" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" "$WHEELS"/*.whl; then
      echo "$listing" > "$site/.dpcourse-wheels"
    else
      echo "gpu-check: installing the wheels from $WHEELS failed (see pip's message above)"
    fi
  fi
  export PYTHONPATH="$site:$PYTHONPATH"
  lacking=$(missing)
fi
if [[ -n $lacking ]]; then
  echo "gpu-check: $py lacks: $lacking. The steps that need them fail."
  if compgen -G "$WHEELS/*.whl" > /dev/null; then
    echo "The wheels in $WHEELS did not provide them (see above)."
  else
    echo "There is no folder of wheels at $WHEELS (WHEELS= names another)."
  fi
  echo "Make one where there is network, from the project's root:"
  echo "\`bash ../shared/gpu/pack-wheels.sh\` (the workplace's shared/gpu; it writes .gpu/whl,"
  echo "which git ignores), or \`python3 -m pip download --only-binary=:all: --python-version 3.12 -d"
  echo ".gpu/whl nbval==0.11.0 ipykernel==6.31.0 ipywidgets==8.1.9 nbclient==0.11.0 nbformat==5.11.1"
  echo "pytest-xdist==3.8.0 pytest-timeout==2.4.0\`; carry .gpu to this machine with the checkout and run again."
fi
lacks() { local m; for m in "$@"; do [[ " $lacking " == *" $m "* ]] && return 0; done; return 1; }

# --- Steps.
elapsed() { echo $(( $(date +%s) - start )); }
header() {  # header STEP COMMAND...: the first lines of each log
  echo "# gpu-check step $1: $machine; $(date -u +%Y-%m-%dT%H:%M:%SZ); commit $commit"
  shift
  echo "# gpu-check command: $command_line"
  if (( $# )); then echo "# this step: $(show "$@")"; fi
}
show() { local q; q=$(printf '%q ' "$@"); echo "${q% }"; }  # a command as it would be typed
record() {  # record NAME STATUS RC SECONDS LIMIT NOTE
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >> "$steps"
}
step() {  # step NAME LIMIT COMMAND...: run it with a time limit, its output in NAME.log; go on
  local what=$1 limit=$2
  shift 2
  local log="$out/$what.log" left=$(( budget - $(elapsed) ))
  if (( left < 20 )); then
    echo "== $what: skipped, $left s left of the time budget ($budget s, GPU_CHECK_BUDGET)"
    record "$what" skipped "" 0 0 "time budget spent"
    return
  fi
  (( limit > left )) && limit=$left
  header "$what" "$@" > "$log"
  echo "== $what (at most $limit s): $(show "$@")"
  local t0 rc
  t0=$(date +%s)
  if [[ -n $dry ]]; then
    echo "[dry run] $(show "$@")" | tee -a "$log"; rc=0
  elif [[ -n ${STEP_QUIET:-} ]]; then
    timeout --signal=INT --kill-after=30 "$limit" "$@" >> "$log" 2>&1; rc=$?
  else
    timeout --signal=INT --kill-after=30 "$limit" "$@" 2>&1 | tee -a "$log"; rc=${PIPESTATUS[0]}
  fi
  local took=$(( $(date +%s) - t0 )) status=passed
  case $rc in 0) ;; 124|137) status="timed out" ;; *) status=failed ;; esac
  if [[ -z $dry ]]; then  # what still holds the GPU (a rank pool left behind would show here)
    { echo "# processes on the GPUs after this step (a notebook's ranks exit within a second or two of its kernel):"
      nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv 2>&1; } >> "$log"
  fi
  echo "== $what: $status ($rc) after $took s; log $log"
  record "$what" "$status" "$rc" "$took" "$limit" ""
}
not_run() {  # not_run NAME WHY
  echo "== $1: not run: $2"
  record "$1" "not run" "" 0 0 "$2"
}

summarize() {  # summary.md and summary.json from the steps' records and logs
  "$py" - "$out" "$steps" "$machine" "$date_utc" "$commit" "$command_line" "$budget" "$(elapsed)" <<'EOF'
import json, re, sys
from pathlib import Path

out, steps_file, machine, date, commit, command, budget, took = sys.argv[1:]
COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)\b")
steps = []
for line in Path(steps_file).read_text().splitlines():
    name, status, rc, seconds, limit, note = line.split("\t")
    step = dict(step=name, status=status, exit_code=int(rc) if rc else None,
                seconds=int(seconds), limit_s=int(limit), note=note, counts={}, failing=[],
                last_line="")
    log = Path(out) / (f"{name}.log" if name != "environment" else "environment.txt")
    step["log"] = log.name if log.exists() else ""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    for text in reversed(lines):  # pytest's last line: "2 failed, 8 passed, ... in 92.84s"
        if COUNT.search(text) and re.search(r" in [\d.]+s", text):
            step["last_line"] = text.strip("= ")
            for n, what in COUNT.findall(text):
                step["counts"]["errors" if what.startswith("error") else what] = int(n)
            break
    for text in lines:  # the short test summary: "FAILED chapters/x.ipynb::Cell 3 - ..."
        m = re.match(r"(FAILED|ERROR) (\S.*?)(?: - .*)?$", text)
        if m and (".py" in m[2] or ".ipynb" in m[2]) and m[2] not in step["failing"]:
            step["failing"].append(m[2])
    steps.append(step)
summary = dict(machine=machine, date=date, commit=commit, command=command,
               budget_s=int(budget), seconds=int(took), steps=steps,
               passed=all(s["status"] == "passed" for s in steps))
Path(out, "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
md = [f"# gpu-check: {'passed' if summary['passed'] else 'FAILED'}", "",
      f"- machine: {machine}", f"- date: {date}", f"- commit: {commit}",
      f"- command: `{command}`", f"- took: {took} s of a {budget} s budget", "",
      "| step | status | passed | failed | errors | skipped | seconds | limit | log |",
      "|---|---|---|---|---|---|---|---|---|"]
for s in steps:
    c = s["counts"]
    md.append(f"| {s['step']} | {s['status']}{' (' + s['note'] + ')' if s['note'] else ''} | "
              + " | ".join(str(c.get(k, "")) for k in ("passed", "failed", "errors", "skipped"))
              + f" | {s['seconds']} | {s['limit_s'] or ''} | {s['log']} |")
for s in steps:
    if s["failing"]:
        md += ["", f"## {s['step']}: {len(s['failing'])} failing", ""]
        md += [f"- `{f}`" for f in s["failing"]]
Path(out, "summary.md").write_text("\n".join(md) + "\n")
EOF
}

publish() {  # the summary, and the copies for GPU_CHECK_OUT
  summarize || echo "gpu-check: could not write the summary"
  [[ -z ${GPU_CHECK_OUT:-} ]] && return 0
  mkdir -p "$GPU_CHECK_OUT"
  local tarball="$GPU_CHECK_OUT/gpu-check-logs.tar.gz" f
  for f in summary.md summary.json environment.txt; do
    [[ -f $out/$f ]] && cp "$out/$f" "$GPU_CHECK_OUT/"
  done
  # At most 8 files: the 3 above, the logs' tarball, and the benchmarks' JSON files (up to 4;
  # fsdp_offload.json, the fifth, travels in the tarball).
  find "$out" -maxdepth 1 -name '*.json' ! -name summary.json ! -name fsdp_offload.json | sort |
    head -n 4 |
    while read -r f; do cp "$f" "$GPU_CHECK_OUT/"; done
  (cd "$out" && shopt -s nullglob && files=(*.log *.json *.txt *.md) &&
    { [[ ! -d notebook-reports ]] || files+=(notebook-reports); } && tar -czf "$tarball" -- "${files[@]}")
  if [[ $(stat -c %s "$tarball" 2>/dev/null || echo 0) -gt $(( 15 * 1024 * 1024 )) ]]; then
    local cut
    cut=$(mktemp -d)
    cp -r "$out"/. "$cut"/ && find "$cut" -name '*.log' -size +1M \
      -exec sh -c 'tail -c 1048576 "$1" > "$1.t" && mv "$1.t" "$1"' _ {} \;
    (cd "$cut" && tar -czf "$tarball" -- *)
    rm -rf "$cut"
  fi
}

# (a) The environment.
{
  header environment
  echo "command: $command_line"
  echo "date: $date_utc"
  echo "commit: $commit $(git status --short 2>/dev/null | grep -qv '^??' && echo '(with changes)')"
  echo "python: $py ($origin)"
  echo "PYTHONPATH: $PYTHONPATH"
  echo "host: $(hostname); $cores CPU cores; $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 2^20}' /proc/meminfo) memory"
  uname -srm
  timeout 60 "$py" - <<'EOF' 2>&1
import importlib.metadata as md, platform, torch
print("Python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| cuDNN", torch.backends.cudnn.version() if torch.cuda.is_available() else None)
try:
    print("NCCL", ".".join(map(str, torch.cuda.nccl.version())))
except Exception as exc:
    print("NCCL: not available:", exc)
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
print("GPUs:", n)
for i in range(n):
    free, total = torch.cuda.mem_get_info(i)
    print(f"  cuda:{i}: {torch.cuda.get_device_name(i)}, {free / 2**30:.1f} GiB free of {total / 2**30:.1f}")
for name in ("numpy", "pytest", "pytest-xdist", "pytest-timeout", "nbval", "ipykernel", "nbclient"):
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name}: missing")
EOF
  echo
  timeout 30 nvidia-smi 2>&1 || echo "(nvidia-smi failed)"
} > "$out/environment.txt" 2>&1
record environment passed 0 "$(elapsed)" 0 ""
echo "== environment: $out/environment.txt"
publish

# (b) The tests marked gpu / multigpu (they skip where the GPUs are missing).
# --continue-on-collection-errors: a test file that cannot be imported here (the website's, where
# the image lacks Sphinx) must not hide every other test's result (the second GPU run lost its GPU
# tests so).
pyt=("$py" -m pytest -p no:cacheprovider --continue-on-collection-errors)
if lacks pytest pytest_timeout; then not_run gpu-tests "missing: $lacking"
else step gpu-tests "$GPU_TESTS_TIMEOUT" "${pyt[@]}" -m "gpu or multigpu" -rfEs -q tests; fi
publish

# (d) The unit tests, with GPU_UNIT: but the gpu ones (step b) and the website's (no site here).
units=(env DPCOURSE_KEEP_RANKS=0 "${pyt[@]}" tests -m "not gpu and not multigpu" -q
  --ignore=tests/test_browser.py --ignore=tests/test_links.py --ignore=tests/test_site.py)
(( UNIT_JOBS > 0 )) && units+=(-n "$UNIT_JOBS" --dist loadfile)
unit_pid=""
if [[ $GPU_UNIT == parallel ]]; then  # beside the notebooks, where the memory is there
  want=${GPU_UNIT_PARALLEL_GIB:-100}
  free_gpu=$(nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits 2>/dev/null |
    sort -n | head -n 1)
  free_host=$(awk '/MemAvailable/ {printf "%d", $2 / 2^20}' /proc/meminfo)
  if [[ -n $dry ]] || (( ${free_gpu:-0} / 1024 >= want && free_host >= 64 )); then
    if lacks pytest pytest_timeout xdist hypothesis; then not_run unit-tests "missing: $lacking"
    else STEP_QUIET=1 step unit-tests "$UNIT_TIMEOUT" "${units[@]}" & unit_pid=$!; fi
  else
    echo "== unit-tests: after the notebooks: $(( ${free_gpu:-0} / 1024 )) GiB free on the GPU" \
      "(GPU_UNIT_PARALLEL_GIB=$want wanted) and $free_host GiB on the host (64 wanted)"
    GPU_UNIT=1
    budget=${GPU_CHECK_BUDGET:-$(budget_for 1)}
  fi
fi

# (c) Every notebook under nbval, NOTEBOOK_JOBS at a time.
notebooks=(env DPCOURSE_CHECKS_STRICT=1 DPCOURSE_KEEP_RANKS="$KEEP_RANKS" "${pyt[@]}" chapters
  --nbval-lax --nbval-current-env --nbval-cell-timeout="$CELL_TIMEOUT" --timeout=0 --durations=20
  --executed-dir=_build/executed-gpu)
(( NOTEBOOK_JOBS > 0 )) && notebooks+=(-n "$NOTEBOOK_JOBS" --dist loadfile)
if lacks pytest pytest_timeout nbval nbformat nbclient ipykernel ipywidgets ||
   { (( NOTEBOOK_JOBS > 0 )) && lacks xdist; }; then
  not_run notebooks "missing: $lacking"
else
  rm -rf _build/executed-gpu
  step notebooks "$NOTEBOOKS_TIMEOUT" "${notebooks[@]}"
  while read -r report; do  # each failing notebook's tracebacks
    mkdir -p "$out/notebook-reports" && cp "$report" "$out/notebook-reports/"
  done < <(find _build/executed-gpu -name '*.err.log' 2>/dev/null)
  # what every cell printed (the measurements a GPU makes), by nbval's cell number
  "$py" - _build/executed-gpu "$out/notebook-outputs.txt" <<'PY' || true
import json, pathlib, sys

root, dest = pathlib.Path(sys.argv[1]), sys.argv[2]
with open(dest, "w") as out:
    for path in sorted(root.rglob("*.ipynb")):
        code = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
        for n, cell in enumerate(code):
            text = "".join(
                "".join(o.get("text", "")) if o.get("output_type") == "stream"
                else "".join(o.get("data", {}).get("text/plain", ""))
                for o in cell.get("outputs", []))
            if text.strip():
                out.write(f"== {path.name} cell {n}\n{text[-4000:]}\n")
PY
fi
if [[ -n $unit_pid ]]; then
  echo "== waiting for unit-tests"
  wait "$unit_pid"
elif [[ $GPU_UNIT == 1 ]]; then
  publish
  if lacks pytest pytest_timeout hypothesis || { (( UNIT_JOBS > 0 )) && lacks xdist; }; then
    not_run unit-tests "missing: $lacking"
  else step unit-tests "$UNIT_TIMEOUT" "${units[@]}"; fi
fi
publish

# (e) The benchmarks, into the results folder.
ranks=$(( gpus >= 2 ? gpus : 2 ))
bench=(env DPCOURSE_KEEP_RANKS=0 "$py" -m dpcourse.harness.bench)
step bench-allreduce "$BENCH_TIMEOUT" "${bench[@]}" allreduce --world-size "$ranks" \
  --json "$out/allreduce-$ranks.json"
step bench-ddp "$BENCH_TIMEOUT" "${bench[@]}" ddp --world-size "$ranks" --repeats 20 \
  --json "$out/ddp.json"
step bench-zero "$BENCH_TIMEOUT" "${bench[@]}" zero --world-sizes "$ranks" --repeats 10 \
  --json "$out/zero.json"
step bench-fsdp-streams "$BENCH_TIMEOUT" "${bench[@]}" fsdp_streams --world-size "$ranks" \
  --json "$out/fsdp_streams.json"
offload_ranks=$(( gpus >= 2 ? gpus : 1 ))  # ranks sharing a GPU run gloo: fully_shard crashed there
step bench-fsdp-offload "$BENCH_TIMEOUT" "${bench[@]}" fsdp_offload --world-size "$offload_ranks" \
  --repeats 3 --json "$out/fsdp_offload.json"
publish

failed=$(awk -F'\t' '$2 != "passed" { printf " %s (%s)", $1, $2 }' "$steps")
echo "gpu-check took $(elapsed) s (budget $budget s); summary: $out/summary.md${GPU_CHECK_OUT:+; copied to $GPU_CHECK_OUT}"
if [[ -n $failed ]]; then
  echo "gpu-check failed:$failed"
  exit 1
fi
