#!/usr/bin/env bash
# One call on the GPU machine: the CUDA transfer tests of the tree, then the submission
# probe, then bench/transfers.py before and after a change, three times each (the order
# alternating), in the same
# call (the old package under before/asyncpin: `git archive REV asyncpin | tar -x -C
# before`). Run from the repository root with .whl/ and before/ carried:
#
#     bash bench/transfers_ab.sh        # $OUT: test log, sections.json, tr-{before,after}-N.json
set -uo pipefail
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
A=/tmp/site:$PWD; B=/tmp/site:$PWD/before
export PYTHONPATH=$A
t0=$SECONDS
timeout 240 python3 -m pytest -p pytest_asyncio.plugin -p anyio -q -rs -m cuda tests/cuda/test_cuda_transfers.py tests/cuda/test_cuda_alignment.py tests/cuda/test_cuda_layouts.py tests/test_conformance.py > $OUT/cuda-transfer-tests.log 2>&1
rc=$?; echo "transfer tests rc=$rc $((SECONDS-t0)) s: $(tail -1 $OUT/cuda-transfer-tests.log)"
grep -E "^FAILED|^ERROR" $OUT/cuda-transfer-tests.log | head
if [ $rc != 0 ]; then grep -B5 -A30 "Error\b" $OUT/cuda-transfer-tests.log | head -60; exit 1; fi
timeout 120 python3 bench/probes/submit_sections.py --json-out $OUT/sections.json > $OUT/sections.log 2>&1; echo "sections rc=$?"
for rep in 1 2 3; do sides="before after"; [ $((rep % 2)) = 0 ] && sides="after before"; for side in $sides; do
  P=$A; [ $side = before ] && P=$B
  PYTHONPATH=$P timeout 90 python3 bench/transfers.py --only sizes,latency --json-out $OUT/tr-$side-$rep.json > /tmp/tr-$side-$rep.log 2>&1; echo "transfers $side $rep rc=$? $((SECONDS-t0)) s"
done; done
tail -12 $OUT/sections.log
python3 - <<'PY'
import json,os,glob
out=os.environ["OUT"]
for f in sorted(glob.glob(out+"/tr-*.json")):
    d=json.load(open(f)); t=d["transfers"]["sizes"]; a=d["await"]
    print(os.path.basename(f), " ".join(f"{k}: st {v['store_gbps']:.1f} ld {v['load_gbps']:.1f} both {v['both_gbps']:.1f} (contig {v['contiguous_store_gbps']:.1f}/{v['contiguous_load_gbps']:.1f}/{v['contiguous_both_gbps']:.1f})" for k,v in t.items()), f"await p50/p99 {a['p50_us']:.0f}/{a['p99_us']:.0f} submit {a['submit_p50_us']:.0f}")
PY
