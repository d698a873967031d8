#!/usr/bin/env bash
# One call on the GPU machine (H200; under 550 s with a 600 s limit): the CUDA tests, then
# the headline figures before and after a change, alternating, in the same call.
#
#   BEFORE=before bash bench/gpu_pass.sh
#
# $BEFORE: a directory holding the old package as asyncpin/ (default before/); the new one
# is this working tree. Each repeat runs bench/pinning.py and bench/transfers.py once
# against each, the order alternating between repeats. Env: SKIP_TESTS=1 skips the tests;
# CUDA_TESTS_S (default 420): the tests' limit; REPEATS (default 3); QUICK=1 adds --quick to each run (a smoke test without a GPU); DEADLINE_S (default 530): no bench run starts when it could end
# past it. AFTER_ONLY (default "layerwise llama_ttft"): scripts run once, on the new tree only,
# their JSON under $OUT. Under $OUT: cuda-tests.log, pass.json (every figure, every run, the table's
# medians), logs.tar.gz (each run's output), summary.txt (the table printed last).
set -uo pipefail
OUT=${OUT:-/tmp/asyncpin-out}
BEFORE=$(realpath "${BEFORE:-before}")
REPEATS=${REPEATS:-3}
DEADLINE_S=${DEADLINE_S:-530}
RUNS=/tmp/gpu-pass-runs
mkdir -p "$OUT" "$RUNS"
[ -d "$BEFORE/asyncpin" ] || { echo "no $BEFORE/asyncpin: extract the old tree first"; exit 2; }
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONUNBUFFERED=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
AFTER_PATH=/tmp/site:$PWD
BEFORE_PATH=/tmp/site:$BEFORE
export PYTHONPATH=$AFTER_PATH
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  t0=$SECONDS
  # The whole CUDA suite took ~345 s on a fresh H200 machine (runs 91-93): a call that
  # runs it leaves little for the figures (SKIP_TESTS=1 for a figures-only call).
  timeout "${CUDA_TESTS_S:-420}" python3 -m pytest -p pytest_asyncio.plugin -p anyio -q -rs -m cuda tests \
    > "$OUT/cuda-tests.log" 2>&1
  echo "cuda tests rc=$? in $((SECONDS - t0)) s: $(tail -1 "$OUT/cuda-tests.log")"
fi

# Seconds one run of each script took (the first run's measure replaces the guess).
declare -A COST=([pinning]=25 [transfers]=25)
run() {  # run SCRIPT SIDE REPEAT ARGS...
  local script=$1 side=$2 rep=$3; shift 3
  local path=$AFTER_PATH; [ "$side" = before ] && path=$BEFORE_PATH
  local left=$((DEADLINE_S - SECONDS))
  if [ $left -lt $((COST[$script] + 5)) ]; then
    echo "skip $script $side $rep: ${left} s left"; return
  fi
  local t0=$SECONDS
  PYTHONPATH=$path timeout $left python3 "bench/$script.py" "$@" ${QUICK:+--quick} \
    --json-out "$RUNS/$script-$side-$rep.json" > "$RUNS/$script-$side-$rep.log" 2>&1
  local rc=$?
  COST[$script]=$((SECONDS - t0))
  echo "$script $side #$rep rc=$rc ${COST[$script]} s"
  grep -q "\"asyncpin_path\": \"$(realpath "${path#/tmp/site:}")/asyncpin\"" \
    "$RUNS/$script-$side-$rep.json" 2>/dev/null || echo "  WARNING: $script $side did not import the $side tree"
}
for rep in $(seq 1 "$REPEATS"); do
  sides="before after"; [ $((rep % 2)) = 0 ] && sides="after before"
  for side in $sides; do
    run pinning "$side" "$rep" --size 16GiB --repeats 2 --no-peer
    run transfers "$side" "$rep" --repeats 30 --samples 300
  done
done
# Figures of the new tree alone (no before): $AFTER_ONLY, default the layer-wise loads and the Llama TTFT.
for script in ${AFTER_ONLY-layerwise llama_ttft}; do
  left=$((DEADLINE_S + 60 - SECONDS))
  if [ $left -lt 30 ]; then echo "skip $script: ${left} s left"; continue; fi
  PYTHONPATH=$AFTER_PATH timeout $left python3 "bench/$script.py" ${QUICK:+--quick} \
    --json-out "$OUT/$script.json" > "$RUNS/$script-after.log" 2>&1
  echo "$script rc=$?"; tail -8 "$RUNS/$script-after.log"
done
tar -czf "$OUT/logs.tar.gz" -C "$RUNS" .
PYTHONPATH=$AFTER_PATH python3 -m bench._compare "$RUNS" "$OUT/pass.json" | tee "$OUT/summary.txt"
echo "total $SECONDS s"
