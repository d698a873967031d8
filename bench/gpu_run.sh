#!/usr/bin/env bash
# One pass on the GPU machine: install the carried wheels, run every test (CUDA ones
# included), the demo, and the CUDA pinning bench. Writes logs and JSON under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/asyncpin-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
python3 -c "import torch, pytest; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'pytest', pytest.__version__)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
uname -r; cat /sys/kernel/mm/transparent_hugepage/enabled; nproc; free -g | head -2

steps=${STEPS:-tests demo bench}
for step in $steps; do
  case $step in
    tests)
      timeout 420 python3 -m pytest -p pytest_asyncio.plugin -q -rs ${PYTEST_ARGS:-} \
        --junitxml "$OUT/tests.xml" 2>&1 | tee "$OUT/tests.log" | tail -40 ;;
    demo)
      timeout 120 python3 -m asyncpin demo --size 8GiB --json > "$OUT/demo.json" 2> "$OUT/demo.err"
      echo "demo rc=$?"; head -c 1500 "$OUT/demo.json"; echo ;;
    lag)
      timeout 200 python3 bench/loop_lag.py --size 16GiB --json-out "$OUT/loop_lag.json" \
        2>&1 | tee "$OUT/loop_lag.log" | tail -12 ;;
    ttests)
      timeout 300 python3 -m pytest -p pytest_asyncio.plugin -q -x -rs -m cuda \
        tests/cuda/test_cuda_transfers.py 2>&1 | tee "$OUT/ttests.log" | tail -30 ;;
    transfers)
      timeout 400 python3 bench/transfers.py --json-out "$OUT/transfers.json" \
        --plot "$OUT/transfers.png" --only "${ONLY:-sizes,matmul,latency}" 2>&1 | tee "$OUT/transfers.log" | tail -25 ;;
    profile)
      timeout 200 python3 bench/submit_profile.py ${PROFILE_ARGS:-} 2>&1 | tee "$OUT/profile.log" \
        | grep -E "submit p50|tottime|^ +[0-9]+ +[0-9.]+ +[0-9.]+" | head -60 ;;
    costs)
      timeout 300 python3 bench/submit_costs.py --only "${COSTS_ONLY:-costs,streams,both}" --json-out "$OUT/submit_costs.json" 2>&1 \
        | tee "$OUT/costs.log" | tail -60 ;;
    soak)
      timeout 420 python3 bench/soak.py --seconds ${SOAK_S:-200} --json-out "$OUT/soak.json" 2>&1 \
        | tee "$OUT/soak.log" | tail -30 ;;
    doctor)
      python3 -m asyncpin doctor 2>&1 | tee "$OUT/doctor.log"
      python3 -m asyncpin doctor --json > "$OUT/doctor.json" 2>&1; echo "doctor --json rc=$?" ;;
    pinq)
      timeout 300 python3 bench/cuda_pinning.py --size 16GiB --configs 1 --repeats 3 \
        --json-out "$OUT/cuda_pinning_q.json" 2>&1 | tee "$OUT/pinq.log" | tail -14 ;;
    bench)
      timeout 400 python3 bench/cuda_pinning.py --size 16GiB --big ${BIG:-64GiB} \
        --json-out "$OUT/cuda_pinning.json" 2>&1 | tee "$OUT/bench.log" | tail -40 ;;
  esac
done
