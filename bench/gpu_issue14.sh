#!/usr/bin/env bash
# One pass on the GPU machine for the hardening work: every CUDA test, the CPU tests of the
# lifecycle, region, transfer-order, signal and README paths with a GPU visible (there
# backend="auto" pins through CUDA and uvicorn runs on uvloop), the demo over a shared
# region, and the 32 KiB-block transfer figures. Logs and JSON under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/asyncpin-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
python3 -c "import torch, uvloop; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'uvloop', uvloop.__version__)"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$SECONDS
timeout 280 python3 -m pytest -p pytest_asyncio.plugin -q -rs -m cuda \
  > "$OUT/cuda-tests.log" 2>&1; echo "cuda tests rc=$? $((SECONDS-t0)) s"
tail -2 "$OUT/cuda-tests.log"
t1=$SECONDS
timeout 230 python3 -m pytest -p pytest_asyncio.plugin -q -rs -m "not cuda" -p no:randomly \
  tests/test_region_hardening.py tests/test_lifecycle_tasks.py tests/test_transfer_order.py \
  tests/test_signals.py tests/test_readme.py tests/test_process_faults.py \
  > "$OUT/cpu-tests-on-gpu-host.log" 2>&1; echo "cpu tests on the GPU host rc=$? $((SECONDS-t1)) s"
tail -2 "$OUT/cpu-tests-on-gpu-host.log"
timeout 60 python3 -m asyncpin demo --size 8GiB --backing shared --name asyncpin-gpu-demo --json \
  > "$OUT/demo.json" 2> "$OUT/demo.err"; echo "demo rc=$? shm left: $(ls /dev/shm | grep -c asyncpin)"
left=$((560 - SECONDS))
if [ $left -gt 60 ]; then
  timeout $left python3 bench/transfers.py --only sizes --block-kib 32 --json-out "$OUT/transfers.json" \
    > "$OUT/transfers.log" 2>&1; echo "transfers rc=$?"; tail -12 "$OUT/transfers.log"
fi
