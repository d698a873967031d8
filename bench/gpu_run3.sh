pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
A=/tmp/site:$PWD; B=/tmp/site:$PWD/before
export PYTHONPATH=$A
t0=$SECONDS
timeout 150 python3 -m pytest -p pytest_asyncio.plugin -p anyio -q -rs -m cuda tests/cuda/test_cuda_transfers.py > $OUT/cuda-transfer-tests.log 2>&1
rc=$?; echo "transfer tests rc=$rc $((SECONDS-t0)) s: $(tail -1 $OUT/cuda-transfer-tests.log)"
grep -E "^FAILED|^ERROR" $OUT/cuda-transfer-tests.log | head
if [ $rc != 0 ]; then grep -B5 -A30 "Error\b" $OUT/cuda-transfer-tests.log | head -60; exit 1; fi
timeout 120 python3 bench/probes/submit_sections.py --json-out $OUT/sections.json > $OUT/sections.log 2>&1; echo "sections rc=$?"
for rep in 1 2; do for side in before after; do
  P=$A; [ $side = before ] && P=$B
  PYTHONPATH=$P timeout 90 python3 bench/transfers.py --only sizes,latency --json-out $OUT/tr-$side-$rep.json > /tmp/tr-$side-$rep.log 2>&1; echo "transfers $side $rep rc=$? $((SECONDS-t0)) s"
done; done
timeout $((560-SECONDS)) python3 -m pytest -p pytest_asyncio.plugin -p anyio -q -rs -m cuda tests --ignore=tests/cuda/test_cuda_transfers.py > $OUT/cuda-tests.log 2>&1; echo "other cuda tests rc=$? $((SECONDS-t0)) s: $(tail -1 $OUT/cuda-tests.log)"
grep -E "^FAILED|^ERROR" $OUT/cuda-tests.log | head
tail -12 $OUT/sections.log
python3 - <<'PY'
import json,os,glob
out=os.environ["OUT"]
for f in sorted(glob.glob(out+"/tr-*.json")):
    d=json.load(open(f)); t=d["transfers"]["sizes"]; a=d["await"]
    print(os.path.basename(f), " ".join(f"{k}: st {v['store_gbps']:.1f} ld {v['load_gbps']:.1f} both {v['both_gbps']:.1f} (contig {v['contiguous_store_gbps']:.1f}/{v['contiguous_load_gbps']:.1f}/{v['contiguous_both_gbps']:.1f})" for k,v in t.items()), f"await p50/p99 {a['p50_us']:.0f}/{a['p99_us']:.0f} submit {a['submit_p50_us']:.0f}")
PY
